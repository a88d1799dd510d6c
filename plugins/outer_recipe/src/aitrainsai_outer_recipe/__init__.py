"""The recipe outer trainer."""
