"""Structured output: JSON-object / JSON-schema / tool-call constraints on generation.

`spec` is plain data (no grammar library import); `grammar` compiles with xgrammar.
"""
from .spec import SchemaTooLargeError, StructuredOutput, UnsupportedSchemaError, check_schema

__all__ = ["SchemaTooLargeError", "StructuredOutput", "UnsupportedSchemaError", "check_schema"]
