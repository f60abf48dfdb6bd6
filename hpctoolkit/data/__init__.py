"""Samples: the reassembling dataset (`dataset`), the sample record and its buffers (`sample`), and
offline shards (`offline`). Import the names from their modules; this package init imports nothing.
"""
