"""Checksums of the bytes a run moves and keeps: XXH3 on the host (`checksum`), WMIX64 on a GPU
(`devsum`). Import the names from their modules; this package init imports nothing.
"""
