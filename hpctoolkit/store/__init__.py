"""The store: the `ObjectStore` interface (`api`), the Mooncake transport (`mooncake`) and its
master launcher (`mooncake_master`), the in-memory fake (`memory`) and per-stage fragment I/O
(`fragments`).

Import the names from their modules; this package init imports nothing, so loading a recipe (which
reads `store.config`) never pays for torch or mooncake. Nothing imports `mooncake` at module level.
"""
