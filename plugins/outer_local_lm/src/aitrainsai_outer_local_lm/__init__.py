"""The local-lm outer trainer."""
