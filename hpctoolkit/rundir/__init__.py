"""The run directory: the layout of one run's files under `paths.output_dir` (`layout`), and the
one way a record is written so that a reader never sees half of it (`atomic`).

Import the names from their modules; this package init imports nothing.
"""
