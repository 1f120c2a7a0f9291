"""The batch descriptor: the plain-data key that names one captured graph."""

from __future__ import annotations

import attrs

__all__ = ["BatchDescriptor"]


def _positive(instance, attribute, value):
    if value is not None and value < 1:
        raise ValueError(f"BatchDescriptor.{attribute.name} must be >= 1, got {value!r}")


@attrs.frozen(order=False)
class BatchDescriptor:
    """A (padded) batch shape, as a hashable key.

    **Arguments:**
    - `num_tokens`: tokens in the batch, after padding.
    - `num_reqs`: requests in the batch; `None` in the relaxed form used by mixed graphs,
      which serve any number of requests up to `num_tokens`.
    - `uniform`: every request has the same query length (1 for decode, 1+k for
      speculative verification).
    - `has_lora`: the batch runs LoRA adapters.

    !!! example
        >>> BatchDescriptor(8, num_reqs=8, uniform=True).relaxed()
        BatchDescriptor(num_tokens=8, num_reqs=None, uniform=False, has_lora=False)
    """

    num_tokens: int = attrs.field(converter=int, validator=_positive)
    num_reqs: int | None = attrs.field(
        default=None,
        converter=attrs.converters.optional(int),
        validator=_positive,
    )
    uniform: bool = attrs.field(default=False, converter=bool)
    has_lora: bool = attrs.field(default=False, converter=bool)

    def __attrs_post_init__(self):
        if self.num_reqs is not None and self.num_reqs > self.num_tokens:
            raise ValueError(
                f"BatchDescriptor: num_reqs={self.num_reqs} exceeds num_tokens={self.num_tokens}; "
                "every request has at least one token"
            )

    def relaxed(self) -> "BatchDescriptor":
        """The mixed-batch form: any request count, not uniform, same LoRA flag."""
        return BatchDescriptor(self.num_tokens, None, False, self.has_lora)

    @property
    def is_relaxed(self) -> bool:
        return self.num_reqs is None and not self.uniform

    @property
    def reqs_rows(self) -> int:
        """Rows that request-axis buffers have in this graph (num_tokens when relaxed)."""
        return self.num_tokens if self.num_reqs is None else self.num_reqs

    def sort_key(self) -> tuple:
        return (self.num_tokens, self.uniform, self.has_lora, self.num_reqs or 0)

    def __str__(self) -> str:
        parts = [f"tokens={self.num_tokens}"]
        if self.num_reqs is not None:
            parts.append(f"reqs={self.num_reqs}")
        if self.uniform:
            parts.append("uniform")
        if self.has_lora:
            parts.append("lora")
        return "(" + ", ".join(parts) + ")"
