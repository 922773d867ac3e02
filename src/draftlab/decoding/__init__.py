"""The decoding step's pieces: the step's types, verification, sampling, the K policies and statistics."""
