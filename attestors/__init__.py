"""attestors"""
