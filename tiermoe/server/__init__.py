"""The HTTP server: OpenAI and Ollama APIs over the engine, with continuous batching."""
