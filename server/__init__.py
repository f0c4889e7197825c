"""encore.server"""
