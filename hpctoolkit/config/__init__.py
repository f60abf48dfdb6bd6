"""The foundation of every config section: field kinds and their checks (`fields`), the host's
`auto` precisions (`precision`), what a run is pinned to (`pinned_inputs`), and the target layers
a draft config names (`draft`).

Nothing here imports another room of hpctoolkit but `errors`: each section's dataclass lives in the
room that owns it (`store/config.py`, `engine/config.py`, ...) and declares its fields with these
kinds; the recipe that assembles the sections, and the rules across them, are `hpctoolkit.recipe`.
Import the names from their modules; this package init imports nothing.
"""
