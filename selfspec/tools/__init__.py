"""Measurement tools: bench, sweep, correctness and report (see `selfspec <command> --help`).

Every tool generates through `SelfSpecModel.generate`, the same engine path as
`selfspec generate`; there is no benchmark-only code path.
"""
