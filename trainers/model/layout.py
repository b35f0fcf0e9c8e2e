"""Sequence layout facts of the IndexTTS2 GPT that the data checks and the model share.

No torch import: manifest validation uses these before the model is built.
"""
CONDITION_LEN = 32  # conditioning latent vectors per prompt
PREFIX_LEN = CONDITION_LEN + 2  # the conditioning latents, then two speed embeddings
