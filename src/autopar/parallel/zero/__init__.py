"""parallel/zero"""
