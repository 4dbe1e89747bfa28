"""One method name, two calls: `Sandbox.kill(sandbox_id)` on the class, `sbx.kill()` on a sandbox.

E2B's SDK lets both spellings work for kill, set_timeout and get_info; code ported from it uses
either. A descriptor picks the function by how the name is reached, so each form keeps its own
signature and mypy sees the right one on each side.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

ByIdParams = ParamSpec("ByIdParams")
ByIdResult = TypeVar("ByIdResult")
Params = ParamSpec("Params")
Result = TypeVar("Result")


class ClassOrInstanceMethod(Generic[ByIdParams, ByIdResult, Params, Result]):
    """Reached on the class: `by_id` (a plain function taking the sandbox id and connection
    arguments). Reached on an instance: `method` bound to it."""

    def __init__(
        self,
        by_id: Callable[ByIdParams, ByIdResult],
        method: Callable[Concatenate[Any, Params], Result],
    ) -> None:
        self._by_id = by_id
        self._method = method
        self.__doc__ = method.__doc__

    @overload
    def __get__(
        self, obj: None, owner: type[Any] | None = None
    ) -> Callable[ByIdParams, ByIdResult]: ...

    @overload
    def __get__(self, obj: Any, owner: type[Any] | None = None) -> Callable[Params, Result]: ...

    def __get__(self, obj: Any, owner: type[Any] | None = None) -> Callable[..., Any]:
        if obj is None:
            return self._by_id
        return types.MethodType(self._method, obj)


def class_variant(
    by_id: Callable[ByIdParams, ByIdResult],
) -> Callable[
    [Callable[Concatenate[Any, Params], Result]],
    ClassOrInstanceMethod[ByIdParams, ByIdResult, Params, Result],
]:
    """Decorates an instance method with the function its name means on the class."""

    def decorate(
        method: Callable[Concatenate[Any, Params], Result],
    ) -> ClassOrInstanceMethod[ByIdParams, ByIdResult, Params, Result]:
        return ClassOrInstanceMethod(by_id, method)

    return decorate
