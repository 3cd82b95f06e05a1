"""Errors a user can cause. Each names the field, what was wrong and what is allowed."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
