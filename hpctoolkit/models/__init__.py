"""Draft models: shared layers and the trainer hooks' base (`common.trainer`) in `common`, one package per algorithm (`config`, `model`, `loss`,
`trainer`, `serving`), the family table (`families`), the registry of each family's parts
(`registry`), checkpoints (`checkpoint`) and export (`export`).

Import the names from their modules; this package init and the family package inits import
nothing, so loading a recipe (which asks `families` about the draft) never pays for torch. The
modules import only torch, transformers and safetensors, so GPU training hosts without vLLM or
Mooncake can use them.
"""
