"""kvbridge.handshake"""
