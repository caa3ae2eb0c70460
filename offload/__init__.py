"""kvbridge.offload"""
