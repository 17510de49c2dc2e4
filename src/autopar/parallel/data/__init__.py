"""parallel/data"""
