"""encore.backends"""
