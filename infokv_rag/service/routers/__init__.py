"""Route groups: documents (upload, status, ask), openai (chat completions, models), health, page."""
