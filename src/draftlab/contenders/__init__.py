"""Everything a study races and preflights: draftlab's plain modes, HF `generate` and assisted generation,
llama-cpp-python, llama-server and its configurations, and the preflight that checks each engine first."""
