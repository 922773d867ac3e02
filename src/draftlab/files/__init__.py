"""What draftlab reads and writes: the PyPI-shipped assets, prompt sets and safe, atomic file IO."""
