"""Weights kept in block formats (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): the formats
(formats.py, no torch), the tensor that holds a matrix's blocks and multiplies by it (tensor.py),
and the torch dequantisers (dequant.py): the fallback where the native kernels do not run, and the
GPU's path."""
