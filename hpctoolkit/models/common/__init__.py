"""Layers shared by every draft: norms (`norm`), rotary embeddings (`rope`), GQA and MLA attention
(`attention`, `mla`), the MLP (`mlp`), the fused cross-entropy (`fused_ce`), the base config
(`config`) and draft (`draft`), and the training contract every family's trainer is declared
against: the hooks' base class (`trainer`), the batch they read (`batch`), the loss record they
return with its shared pieces (`losses`), and the pruned vocabulary (`vocab`).

Import the names from their modules; this package init imports nothing.
"""
