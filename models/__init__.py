"""encore.models"""
