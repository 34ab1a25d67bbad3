"""control/store"""
