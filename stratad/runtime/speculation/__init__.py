"""Speculative decoding: a drafter proposes a sequence's next tokens, one step verifies them
all (`stratad.runtime.step`), and the sequence keeps the longest prefix its own sampler
agrees with, so greedy output is the output without speculation and sampled output keeps the
model's distribution (`stratad.runtime.sampling.Sampler.verify`)."""
