"""hisparse"""
