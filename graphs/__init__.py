"""encore.graphs"""
