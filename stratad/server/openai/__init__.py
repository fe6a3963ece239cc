"""OpenAI's API: the request types and their jobs (`requests`), the answers of the completion
routes (`answers`) and the response types they are written in (`responses`)."""
