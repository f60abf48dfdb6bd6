"""Layers shared by every draft: norms (`norm`), rotary embeddings (`rope`), GQA and MLA attention
(`attention`, `mla`), the MLP (`mlp`), the fused cross-entropy (`fused_ce`) and the base config
(`config`).

Import the names from their modules; this package init imports nothing.
"""
