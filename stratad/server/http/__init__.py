"""The HTTP plumbing under every front: the listening site and its connection cap
(`listener`), server-sent events (`sse`), cross-origin requests (`cors`)."""
