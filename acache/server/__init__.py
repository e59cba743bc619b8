"""An OpenAI-compatible HTTP server on the paged engine, with automatic affix reuse."""
