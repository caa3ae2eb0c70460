"""kvbridge.integrations"""
