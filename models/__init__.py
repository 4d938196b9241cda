"""Model definitions (the Llama family) and weight loading for asyncengine.

Import from the submodules: `models.loader`, `models.registry`, `models.config`,
`models.default_model`, `models.gguf`.
"""
