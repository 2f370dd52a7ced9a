"""flashnode: the volunteer node agent of the flashruntime distributed ML runtime."""

__version__ = "0.5.0.dev0"
