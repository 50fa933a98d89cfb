"""LLaVA data: conversation encoding, pack collation, the embedded shapes dataset."""
