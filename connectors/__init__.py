"""kvbridge.connectors"""
