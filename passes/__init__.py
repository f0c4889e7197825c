"""encore.passes"""
