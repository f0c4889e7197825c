"""encore.protos"""
