"""capsteer.server"""
