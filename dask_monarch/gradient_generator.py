"""Monarch's module path ``monarch.gradient_generator``: ``from dask_monarch.gradient_generator import
grad_generator, grad_function, gradient_execution_order`` (the same as ``dask_monarch.grad_generator`` ...;
``controller/gradients.py``)."""

from .controller.gradients import grad_function, grad_generator, gradient_execution_order

__all__ = ["grad_function", "grad_generator", "gradient_execution_order"]
