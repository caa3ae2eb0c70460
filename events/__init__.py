"""kvbridge.events"""
