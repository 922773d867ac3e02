"""Draft design: latency microbenchmarks of depth and width in the target's architecture family."""
