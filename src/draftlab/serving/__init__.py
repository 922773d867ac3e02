"""`draftlab serve`: an OpenAI-compatible server on draftlab's exact engine: `scheduler` above the engine's step,
`app` (the HTTP routes), `protocol` (requests and answers), `metrics` (Prometheus text)."""
