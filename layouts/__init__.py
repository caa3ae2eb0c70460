"""kvbridge.layouts"""
