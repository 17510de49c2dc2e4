"""parallel/grads"""
