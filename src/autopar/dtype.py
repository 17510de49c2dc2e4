"""MindSpore's dtype names (``mindspore.dtype`` / ``mindspore.common.dtype as mstype``) as torch dtypes."""
import torch

float16 = torch.float16
float32 = torch.float32
float64 = torch.float64
bfloat16 = torch.bfloat16
int8 = torch.int8
int16 = torch.int16
int32 = torch.int32
int64 = torch.int64
uint8 = torch.uint8
bool_ = torch.bool
float_ = torch.float32
int_ = torch.int32
complex64 = torch.complex64
complex128 = torch.complex128

__all__ = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool_",
           "float_", "int_", "complex64", "complex128"]
