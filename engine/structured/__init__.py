"""Structured output: JSON-object / JSON-schema / tool-call constraints on generation.

`spec` is plain data (no grammar library import); `grammar` compiles with xgrammar.
"""
from .spec import StructuredOutput, UnsupportedSchemaError, check_schema

__all__ = ["StructuredOutput", "UnsupportedSchemaError", "check_schema"]
