"""kvbridge.engine"""
