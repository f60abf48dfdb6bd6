"""Errors shared across the package.

Inside the package a user mistake raises `ConfigError` (a `ValueError`); exactly one function,
`hpctoolkit.cli.run_cli`, turns it into a one-line message and exit code 2. Data-path faults
raise `DataIntegrityError` or `StoreError` and are never downgraded to warnings.
"""


class ConfigError(ValueError):
    """A recipe, override, draft config or CLI argument is wrong. The message names the key."""


class DataIntegrityError(RuntimeError):
    """Training data is missing, partial or inconsistent. The message names the sample key."""


class StoreError(RuntimeError):
    """The Mooncake store is unreachable or refused an operation. The message names the address or key."""


class RoleFailedError(RuntimeError):
    """A role process of a run failed. The message names the role, its last error line and its log."""
