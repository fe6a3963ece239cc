"""The kinds of layer graph a spec states (routing, the gated activation, RoPE scaling,
latent and linear attention), and how far a model departs from the plain decoder."""
